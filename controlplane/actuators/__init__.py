"""Actuators: the one way the control plane changes a fleet (simulator, dry run; Kubernetes later)."""
