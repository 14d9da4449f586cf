"""Test and demo helpers that no serving path imports: the tiny locally built model."""
