"""Examples of validating your own optimizer and model with canzona's exactness gate (see README.md here)."""
