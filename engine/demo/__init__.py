"""The demo pair: its recipe and cache (recipe.py), its training (train.py) and finding or building it (pair.py)."""
