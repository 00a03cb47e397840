//! In-memory execution of schedules for tests (filled in by the schedules work).
