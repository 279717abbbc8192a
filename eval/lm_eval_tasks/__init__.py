"""lm-eval task configurations (YAML) for --include_path, and their data loading and scoring (utils)."""
