"""kvbridge.kvmanager."""
