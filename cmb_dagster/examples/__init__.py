"""Example code location loaded by workspace.yaml."""
