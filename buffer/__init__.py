"""vapo buffer package."""
