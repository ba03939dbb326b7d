//! Serving threads: the main listener's connections are served on `server.threads` OS threads
//! (one per CPU by default), each running a single-threaded tokio runtime of its own, and each
//! with its own pools of upstream connections ([`crate::net::outbound`]).
//!
//! A connection stays on the thread it was handed to, and so do its requests, the writes they
//! send upstream and the upstream connections those writes take. On the work-stealing runtime a
//! write's steps ran on whichever worker was free, its upstream connection's task on the worker
//! that opened it: every write crossed between CPUs a few times, and each crossing woke a thread
//! and moved the request's memory from one CPU's cache to the other's. Measured on the bench
//! (docs/benchmarks.md, "Serving threads"), that was a third of the CPU of an accepted write.
//!
//! What stays on the process's main runtime: the accept loops (a connection is accepted there
//! and handed over, round robin), the admin listener, the start-up probe (its upstream
//! connections are pooled apart from the threads'), and the stores' background tasks
//! (registration renewals, change notices, the shared Redis connection, etcd's); with one
//! Redis, each serving thread opens a Redis connection of its own. A write that a
//! client left is finished on its serving thread; [`ServingThreads::stop`] ends the threads only
//! after the app saw every write settle.

use std::cell::Cell;
use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::runtime::Handle;
use tokio::sync::oneshot;

thread_local! {
    /// The serving thread this is, on one.
    static SERVING: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The index of the serving thread running the caller, `None` on any other thread.
pub fn current() -> Option<usize> {
    SERVING.with(Cell::get)
}

/// Running serving threads. Stopped, or dropped, they end with the tasks still on them.
pub struct ServingThreads {
    handles: Box<[Handle]>,
    next: AtomicUsize,
    /// Dropping a sender ends its thread's runtime.
    stops: Mutex<Vec<oneshot::Sender<()>>>,
    joins: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl ServingThreads {
    /// Starts `count` threads (at least one).
    pub fn start(count: usize) -> std::io::Result<Self> {
        let count = count.max(1);
        let (mut handles, mut stops, mut joins) = (Vec::new(), Vec::new(), Vec::new());
        for index in 0..count {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let (stop, stopped) = oneshot::channel::<()>();
            handles.push(runtime.handle().clone());
            stops.push(stop);
            joins.push(std::thread::Builder::new().name(format!("fencegate-serve-{index}")).spawn(move || {
                SERVING.with(|serving| serving.set(Some(index)));
                let _ = runtime.block_on(stopped);
                // Dropped here, it drops its tasks and waits for its blocking ones (a local
                // upstream's file work), as the main runtime does at exit.
                drop(runtime);
            })?);
        }
        Ok(Self {
            handles: handles.into(),
            next: AtomicUsize::new(0),
            stops: Mutex::new(stops),
            joins: Mutex::new(joins),
        })
    }

    /// Runs `task` on the next serving thread, round robin (once the threads stopped, drops it).
    pub fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let next = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        // The task, not its join handle, is what runs the connection.
        drop(self.handles[next].spawn(task));
    }

    /// Tells every thread to end, with the tasks still on it, without waiting.
    pub fn close(&self) {
        self.stops.lock().expect("serving threads lock poisoned").clear();
    }

    /// Ends every thread, with the tasks still on it, and waits until they are gone. Tasks
    /// may hold the threads themselves (a connection's HTTP/2 streams are spawned on them):
    /// stopping does not wait for the last reference.
    pub async fn stop(&self) {
        self.close();
        let joins = std::mem::take(&mut *self.joins.lock().expect("serving threads lock poisoned"));
        let joined = tokio::task::spawn_blocking(move || {
            for join in joins {
                let _ = join.join();
            }
        });
        let _ = joined.await;
    }
}

/// Closes the threads when dropped: they do not outlive a serving future dropped before its
/// end (their own tasks may hold them, so dropping the last reference elsewhere is not enough).
pub struct CloseOnDrop(pub std::sync::Arc<ServingThreads>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tasks_go_round_robin_and_each_knows_its_thread() {
        let threads = ServingThreads::start(2).unwrap();
        assert_eq!(current(), None, "the test's own thread serves nothing");
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..4 {
            let seen_tx = seen_tx.clone();
            threads.spawn(async move {
                let name = std::thread::current().name().map(str::to_owned);
                seen_tx.send((current(), name)).unwrap();
            });
        }
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(seen.recv().await.unwrap());
        }
        got.sort();
        let expected = |i: usize| (Some(i), Some(format!("fencegate-serve-{i}")));
        assert_eq!(got, vec![expected(0), expected(0), expected(1), expected(1)]);
        threads.stop().await;
    }

    #[tokio::test]
    async fn stopping_ends_the_tasks_left_on_the_threads() {
        let threads = ServingThreads::start(1).unwrap();
        let (ended_tx, ended) = oneshot::channel::<()>();
        threads.spawn(async move {
            let _ended = ended_tx; // dropped when the task is
            std::future::pending::<()>().await;
        });
        threads.stop().await;
        let ended = tokio::time::timeout(std::time::Duration::from_secs(5), ended).await;
        assert!(matches!(ended, Ok(Err(_))), "the pending task was dropped with its thread: {ended:?}");
    }
}
