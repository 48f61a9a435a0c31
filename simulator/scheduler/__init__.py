"""The scheduler's structured allocation of ResourceClaims, with the CEL of device selectors."""
