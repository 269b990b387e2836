"""`meshlm bench NAME`: meshlm's implementation against PyTorch's own, in one invocation."""
