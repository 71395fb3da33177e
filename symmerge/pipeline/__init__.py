"""Alignment pipelines: options, the solver engine shared by in-memory and streamed alignment,
verification and the report."""
