"""Image and video preprocessing with hard caps, and prompt placeholder expansion."""
