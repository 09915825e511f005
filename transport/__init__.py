"""kvbridge.transport."""
