"""Constructors of common masks (filled in below)."""
