"""The Python the C++ kernels call (runner.py: every name of the contract) and the Functions a
node's func_name resolves to (functions.py: registered ones, torch operators as Functions)."""
