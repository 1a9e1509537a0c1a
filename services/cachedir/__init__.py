"""cachedir"""
