package petrel.bench;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;

import net.openhft.chronicle.bytes.Bytes;
import net.openhft.chronicle.queue.ChronicleQueue;
import net.openhft.chronicle.queue.ExcerptAppender;
import net.openhft.chronicle.queue.ExcerptTailer;
import net.openhft.chronicle.queue.impl.single.SingleChronicleQueueBuilder;
import net.openhft.chronicle.wire.DocumentContext;

/**
 * The workload of `petrel bench log` on Chronicle Queue, in two processes as Chronicle is used:
 *
 * <pre>
 *   ChronicleBench append DIR COUNT PAYLOAD_BYTES   appends COUNT records to a new queue in DIR
 *   ChronicleBench tail   DIR COUNT PAYLOAD_BYTES   reads them back, in a process of its own
 * </pre>
 *
 * The tail reads every record twice: with an unnamed tailer (a plain read), and with a named
 * tailer, whose position Chronicle keeps in the queue's directory as it reads (the counterpart of
 * a Petrel consumer group's poll + ack). Each prints one JSON object, in the shape of `petrel
 * bench log --json`. Default options throughout: the default roll cycle and block size, no
 * pretoucher, the page cache's durability (no sync).
 */
public final class ChronicleBench {
    private static final String VERSION = "Chronicle Queue 5.27ea11";

    public static void main(String[] args) throws IOException {
        if (args.length != 4 || !(args[0].equals("append") || args[0].equals("tail"))) {
            System.err.println("usage: ChronicleBench append|tail DIR COUNT PAYLOAD_BYTES");
            System.exit(2);
        }
        Path dir = Paths.get(args[1]);
        long count = Long.parseLong(args[2]);
        int payloadBytes = Integer.parseInt(args[3]);
        if (args[0].equals("append")) {
            append(dir, count, payloadBytes);
        } else {
            tail(dir, count, payloadBytes);
        }
    }

    private static void append(Path dir, long count, int payloadBytes) throws IOException {
        Bytes<?> payload = Bytes.allocateDirect(payloadBytes);
        for (int i = 0; i < payloadBytes; i++) {
            payload.writeByte((byte) (i * 7 + 1)); // the bytes `petrel bench log` appends
        }
        long started;
        long elapsed;
        try (ChronicleQueue queue = SingleChronicleQueueBuilder.single(dir.toFile()).build();
             ExcerptAppender appender = queue.createAppender()) {
            started = System.nanoTime();
            for (long i = 0; i < count; i++) {
                appender.writeBytes(payload);
            }
            elapsed = System.nanoTime() - started;
        }
        payload.releaseLast();
        print("\"append_msgs_per_sec\":" + rate(count, elapsed)
                + ",\"bytes_on_disk\":" + diskUsage(dir)
                + ",\"peak_rss_bytes\":" + peakRss(), count, payloadBytes);
    }

    private static void tail(Path dir, long count, int payloadBytes) throws IOException {
        long read;
        long readNanos;
        long named;
        long namedNanos;
        long checksum = 0;
        try (ChronicleQueue queue = SingleChronicleQueueBuilder.single(dir.toFile()).readOnly(false).build()) {
            try (ExcerptTailer tailer = queue.createTailer()) {
                long started = System.nanoTime();
                read = 0;
                while (true) {
                    try (DocumentContext dc = tailer.readingDocument()) {
                        if (!dc.isPresent()) {
                            break;
                        }
                        Bytes<?> bytes = dc.wire().bytes();
                        checksum += bytes.readRemaining() + bytes.readByte(bytes.readPosition());
                        read++;
                    }
                }
                readNanos = System.nanoTime() - started;
            }
            try (ExcerptTailer tailer = queue.createTailer("bench")) {
                long started = System.nanoTime();
                named = 0;
                while (true) {
                    try (DocumentContext dc = tailer.readingDocument()) {
                        if (!dc.isPresent()) {
                            break;
                        }
                        Bytes<?> bytes = dc.wire().bytes();
                        checksum += bytes.readRemaining() + bytes.readByte(bytes.readPosition());
                        named++;
                    }
                }
                namedNanos = System.nanoTime() - started;
            }
        }
        long expected = 2 * count * (payloadBytes + (payloadBytes > 0 ? 1 : 0));
        if (read != count || named != count || checksum != expected) {
            System.err.println("read " + read + " and " + named + " records of " + count + ", or they differ");
            System.exit(1);
        }
        print("\"read_msgs_per_sec\":" + rate(read, readNanos)
                + ",\"poll_ack_msgs_per_sec\":" + rate(named, namedNanos)
                + ",\"peak_rss_bytes\":" + peakRss(), count, payloadBytes);
    }

    private static void print(String rates, long count, int payloadBytes) {
        System.out.println("{\"peer\":\"" + VERSION + "\",\"count\":" + count + ",\"payload_bytes\":" + payloadBytes
                + "," + rates + "}");
    }

    private static double rate(long n, long nanos) {
        return n / (nanos / 1e9);
    }

    /** Bytes the directory's files take on disk: their allocated blocks, as `du -B1` counts. */
    private static long diskUsage(Path dir) throws IOException {
        Process du = new ProcessBuilder("du", "-s", "-B1", dir.toString()).redirectErrorStream(true).start();
        String out = new String(du.getInputStream().readAllBytes()).trim();
        try {
            if (du.waitFor() != 0) {
                throw new IOException("du: " + out);
            }
        } catch (InterruptedException e) {
            throw new IOException(e);
        }
        return Long.parseLong(out.split("\\s+")[0]);
    }

    /** The process's peak resident memory (VmHWM). */
    private static long peakRss() throws IOException {
        for (String line : Files.readAllLines(Paths.get("/proc/self/status"))) {
            if (line.startsWith("VmHWM:")) {
                return 1024L * Long.parseLong(line.replaceAll("[^0-9]", ""));
            }
        }
        return 0;
    }
}
