"""vapo learner package."""
