"""Optional integrations of the engine with other training frameworks.

Nothing here is imported by the core package: each integration imports its framework, which
is an optional dependency (``pip install protrain[hf]``).
"""
