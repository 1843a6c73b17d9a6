// One member of a Kafka Streams application on the streams rebalance protocol (KIP-1071,
// group.protocol=streams) for the integration tests, run with Java's single-file source
// launcher on the Kafka Streams jars' classpath (scripts.fetch_kafka.ensure_kafka_streams):
//
//     java -cp 'libs/*' StreamsMember.java <bootstrap> <topic> <application id> <state dir> [count]
//
// A stateless topology (no internal topics) that prints "record <value>" per record and
// "state <state>" per state change; with "count", records are also counted by value (a
// repartition topic and a store's changelog, created by the broker for the group) and
// each count printed as "count <value>=<n>".  When stdin closes it closes the application, leaving
// the group, and prints "closed".
import java.io.InputStream;
import java.time.Duration;
import java.util.Properties;
import org.apache.kafka.common.serialization.Serdes;
import org.apache.kafka.streams.CloseOptions;
import org.apache.kafka.streams.KafkaStreams;
import org.apache.kafka.streams.StreamsBuilder;
import org.apache.kafka.streams.StreamsConfig;
import org.apache.kafka.streams.kstream.KStream;

public class StreamsMember {
    public static void main(String[] args) throws Exception {
        String bootstrap = args[0], topic = args[1], applicationId = args[2], stateDir = args[3];
        Properties props = new Properties();
        props.put(StreamsConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        props.put(StreamsConfig.APPLICATION_ID_CONFIG, applicationId);
        props.put(StreamsConfig.GROUP_PROTOCOL_CONFIG, "streams");
        props.put(StreamsConfig.STATE_DIR_CONFIG, stateDir);
        props.put(StreamsConfig.NUM_STREAM_THREADS_CONFIG, 1);
        props.put(StreamsConfig.DEFAULT_KEY_SERDE_CLASS_CONFIG, Serdes.StringSerde.class);
        props.put(StreamsConfig.DEFAULT_VALUE_SERDE_CLASS_CONFIG, Serdes.StringSerde.class);
        props.put("auto.offset.reset", "earliest");
        props.put(StreamsConfig.STATESTORE_CACHE_MAX_BYTES_CONFIG, 0);  // every count printed
        StreamsBuilder builder = new StreamsBuilder();
        KStream<String, String> records = builder.<String, String>stream(topic).peek((key, value) -> {
            System.out.println("record " + value);
            System.out.flush();
        });
        if (args.length > 4 && args[4].equals("count")) {
            records.groupBy((key, value) -> value).count().toStream().foreach((value, n) -> {
                System.out.println("count " + value + "=" + n);
                System.out.flush();
            });
        }
        KafkaStreams streams = new KafkaStreams(builder.build(), props);
        streams.setStateListener((now, before) -> {
            System.out.println("state " + now);
            System.out.flush();
        });
        streams.start();
        try (InputStream in = System.in) {
            while (in.read() >= 0) {
                // nothing to do until the test closes our stdin
            }
        }
        streams.close(CloseOptions.groupMembershipOperation(
            CloseOptions.GroupMembershipOperation.LEAVE_GROUP).withTimeout(Duration.ofSeconds(30)));
        System.out.println("closed");
        System.out.flush();
    }
}
