"""dropless.train"""
