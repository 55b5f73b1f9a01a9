"""Adapters to training frameworks; framework code lives here and nowhere below."""
