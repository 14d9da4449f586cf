"""kvscale operator (see issue: Operator)."""
