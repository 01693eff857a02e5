"""Readers of other frameworks' arguments, logs and golden files -> this product's configs and records."""
