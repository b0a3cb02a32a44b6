"""Developer tools: scripts that (re)make files the repository ships."""
