"""Adapters to other systems' APIs (optional extras; nothing here is imported by default)."""
