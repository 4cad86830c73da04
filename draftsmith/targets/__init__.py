"""The target model: preflight (inspect), weight access, and hidden-state capture backends."""
