"""The simulated vLLM (or SGLang) replica server (``python -m simengine``).

Imports no Django: a replica starts in well under a second and several run on one
machine.
"""
