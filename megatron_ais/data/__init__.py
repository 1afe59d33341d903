"""Tasks, prompt files and rewards."""
