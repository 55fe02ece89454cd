"""flotilla.models."""
