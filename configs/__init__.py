"""Policy files shipped with airlock: default.yaml (used when no policy is given) and a commented example."""
