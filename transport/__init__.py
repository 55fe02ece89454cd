"""flotilla.transport."""
