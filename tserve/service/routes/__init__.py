"""HTTP routes: parse and validate, hand off to the registry's workers, format the answer."""
