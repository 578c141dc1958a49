"""The target service: the large model that verifies draft blocks in one forward pass."""
