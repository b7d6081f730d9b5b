"""Where records go: the never-blocking sender and the sinks it feeds, chosen by URL."""
