"""vapo common package."""
