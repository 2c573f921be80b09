"""Placeholder: this variant is being written."""
