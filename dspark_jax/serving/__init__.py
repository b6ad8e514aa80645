"""Serving on the one engine: a closed-loop load generator and serve-bench."""
