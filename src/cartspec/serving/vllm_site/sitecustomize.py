"""Put on PYTHONPATH of the vLLM servers cartspec starts: applies cartspec.serving.vllm_fixes."""
try:
    from cartspec.serving.vllm_fixes import install
except Exception:  # cartspec not importable in this interpreter: run vLLM unpatched
    pass
else:
    install()
