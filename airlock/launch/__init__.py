"""The launchers: a sandbox (`airlock.sandbox`'s primitives) with its own embedded gateway as one handle —
`netns_launcher.launch()` and `docker_launcher.launch()` (`airlock run` and orchestrators use them), what both
share (`embedded_gateway`), what a netns launch works out before anything exists (`preflight`), the git identity
the command commits with (`git_identity`), and the watchdog process that removes a sandbox whose launcher died
(`watchdog`)."""
