"""Drafts that need a forward pass of a model: self-drafts and small draft models."""
