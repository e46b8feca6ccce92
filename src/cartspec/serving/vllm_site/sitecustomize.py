"""Put on PYTHONPATH of the vLLM servers cartspec starts: applies cartspec.serving.vllm_fixes.

Python imports the first ``sitecustomize`` on the path, so this one also runs the one it shadows
(a distribution's or a user's), if any.
"""
import importlib.util
import os
import sys

try:
    from cartspec.serving.vllm_fixes import install
except Exception:  # cartspec not importable in this interpreter: run vLLM unpatched
    pass
else:
    install()

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _cand = os.path.join(_entry or ".", "sitecustomize.py")
    if os.path.abspath(_entry or ".") != _here and os.path.isfile(_cand):
        _spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", _cand)
        _mod = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_mod)
        break
