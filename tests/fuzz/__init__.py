"""Structure-aware fuzzing of ortbridge PythonOp / PythonOpGrad graphs (see campaign.py)."""
