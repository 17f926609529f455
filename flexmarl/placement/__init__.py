"""Placement as data: which devices form each training mesh, rollout instance and pool mesh (plan.py), and fitting a team to fewer devices (fit.py)."""
