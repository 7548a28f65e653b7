"""The surgery itself: a student made from teacher slices, in memory or from disk to disk,
through the teacher tensor readers."""
