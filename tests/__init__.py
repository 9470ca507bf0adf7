"""The test suite, by layer: model/, engine/, http/, deploy/, training/; shared helpers in helpers/."""
