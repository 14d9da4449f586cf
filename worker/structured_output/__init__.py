"""Constrained decoding: grammars compiled off the step loop, one token bitmask row per sequence."""
