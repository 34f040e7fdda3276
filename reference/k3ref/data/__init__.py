"""Text side of k3-mini: the K3 chat format renderer, its Jinja template, tools, and synthetic tasks."""
