"""Shared libraries every Sluice service stands on: one home per concern."""
