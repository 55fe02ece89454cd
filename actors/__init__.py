"""flotilla.actors."""
