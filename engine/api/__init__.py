"""The public API: Engine, its config objects and the profile reader."""
