"""vapo actors package."""
