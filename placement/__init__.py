"""Expert placement as pure math (numpy, cvxpy, pydantic; no torch, no ray)."""
