"""Stand-ins for the test suite and the load generator's own benchmarks; nothing here is measured.

``trivial_server``: an OpenAI-compatible streaming server that answers at a fixed pace (no model).
"""
