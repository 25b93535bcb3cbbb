"""The credential broker: privileged actions for sandboxes that hold only a short-lived, scoped token."""
