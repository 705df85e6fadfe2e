"""What the EPP knows of its pool: discovery (static file or Kubernetes), per-endpoint metrics scraping, in-flight
accounting."""
