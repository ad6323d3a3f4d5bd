"""Connecting and acting: configuration, the store, the control loop, actuators, rails, CLI."""
